"""Load once (checkpoint/share.py): the state rank 0 read reaches the other ranks with the same
structure, dtypes, shapes and bits, and a lazily loaded checkpoint reads none of its tensors. The
torchrun restarts of test_fault_tolerance.py prove it over real process groups (bitwise resumes)."""

from __future__ import annotations

import pickle

import torch

from imagenet_elastic.checkpoint import share, store


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 5, generator=g)
    return {
        "model": {"w": weight, "t": weight.t(), "half": torch.randn(7, generator=g).to(torch.bfloat16),
                  "count": torch.tensor(17), "mask": torch.tensor([True, False, True]),
                  "empty": torch.empty(0, 3)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(3, 1, 2, generator=g, dtype=torch.float64)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "rng": {"torch": torch.Generator().manual_seed(5).get_state(), "python": [3, [1, 2], None]},
        "history": [{"epoch": 1, "val_top1": 50.0}],
        "shape": (2, 3),
        "saved_at": 1.5,
    }


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_pack_then_unpack_gives_back_every_tensor_bit_for_bit_and_the_structure():
    state = sample_state()
    skeleton, buffer = share.pack(state)
    skeleton = pickle.loads(pickle.dumps(skeleton))  # what the object broadcast does to it
    assert buffer.dtype == torch.uint8
    assert_same(state, share.unpack(skeleton, buffer.clone()))


def read_bytes() -> int:
    """What this process has read with read() and friends (mapped pages that are never touched do not count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_lazy_load_reads_the_numbers_and_not_the_tensors(tmp_path):
    path = tmp_path / "last.pt"
    weights = torch.arange(1 << 22, dtype=torch.float32)  # 16 MB
    torch.save({"model": {"w": weights}, "epoch": 3, "step": 40, "saved_at": 2.5}, path)
    before = read_bytes()
    lazy = store.load(str(path), lazy=True)
    lazy_read = read_bytes() - before
    assert (lazy["epoch"], lazy["step"], lazy["saved_at"]) == (3, 40, 2.5)
    before = read_bytes()
    full = store.load(str(path))
    full_read = read_bytes() - before
    assert full_read > 16e6 and lazy_read < 1e6, (lazy_read, full_read)
    assert torch.equal(lazy["model"]["w"], full["model"]["w"])  # and the tensors are there when used
