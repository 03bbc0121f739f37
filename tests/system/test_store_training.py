"""Training from an object store: a pack and foreign WebDataset shards in a real S3 server (moto's, in its own
process), a pack written to a GCS emulator, and a pack behind an HTTP server with ranges, through a proxy that counts
what is read and injects faults. A run from the store is bitwise the run from the same shards on disk; each shard is
read from the store once per node; 503s and resets cost retries, not the run; a store that stays away ends the run
with one line and its checkpoint intact, and --resume continues it bitwise; a SIGKILLed torchrun job resumes from the
store at another world size; bad input is one line before any work."""

from __future__ import annotations

import io
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import store_servers
from conftest import (
    SMALL_RUN,
    assert_names,
    assert_same_tensors,
    child_env,
    load_checkpoint,
    python_cmd,
    run_and_kill,
    single_line,
    torchrun_cmd,
    torchrun_worker,
)
from inprocess import command, train
from makers import run_pack, wds_shards

from imagenet_elastic.data.sources import object_store, open_source, tar_shards
from imagenet_elastic.data.sources.object_store import StoreUnavailable
from imagenet_elastic.errors import UserError, one_line

pytestmark = pytest.mark.slow  # servers in processes of their own
RUN = [*SMALL_RUN, "--threads", "1", "--max-steps-per-epoch", "3", "--global-batch-size", "16"]
BUCKET = "imagenet"


@pytest.fixture(scope="module")
def shards(image_folder, tmp_path_factory) -> Path:
    """The fixture's class folders as a pack (pack/) and as foreign WebDataset shards with a classes.txt (wds/)."""
    root = tmp_path_factory.mktemp("store")
    run_pack(str(image_folder), str(root / "pack"), "--shard-size", "20")
    for split in ("train", "val"):
        wds_shards(image_folder / split, root / "wds" / split, per_shard=25)
    (root / "wds" / "classes.txt").write_text((root / "pack" / "classes.txt").read_text())
    return root


@pytest.fixture(scope="module")
def bucket(s3_server, shards) -> str:
    s3_server.put_folder(shards, BUCKET)
    return BUCKET


@pytest.fixture(scope="module")
def disk_run(shards, tmp_path_factory) -> Path:
    """Two epochs from the pack on disk, one loader worker: the weights every run from the store must have."""
    ckpt = tmp_path_factory.mktemp("disk_run")
    train([str(shards / "pack"), *RUN, "--workers", "1", "--epochs", "2", "--checkpoints-path", str(ckpt)])
    return ckpt


@pytest.fixture
def store_env(monkeypatch, tmp_path):
    """This process's environment pointed at a server (`store_env(server_or_proxy)`), with a node cache of its own
    and a short bound on a store that does not answer. The cache has a cap of its own: with none, its room would be
    the host's free disk, and a test the host's disk."""

    def point(server, cache: Path = tmp_path / "node-cache", timeout: str = "20", cap_gb: str = "1") -> Path:
        ours = {"IMAGENET_ELASTIC_STORE_CACHE": str(cache), "IMAGENET_ELASTIC_STORE_TIMEOUT": timeout,
                "IMAGENET_ELASTIC_STORE_CACHE_GB": cap_gb}
        for name, value in {**server.env(), **ours}.items():
            monkeypatch.setenv(name, value)
        return cache

    return point


def same_weights(ckpt: Path, reference: Path) -> None:
    ours, theirs = load_checkpoint(ckpt / "last.pt"), load_checkpoint(reference / "last.pt")
    assert_same_tensors(ours["model"], theirs["model"])
    assert [r["val_top1"] for r in ours["history"]] == [r["val_top1"] for r in theirs["history"]]


def store_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_pack_in_s3_trains_bitwise_as_on_disk_reading_each_byte_from_the_store_once(
        s3_server, bucket, shards, disk_run, fault_proxy, store_env, tmp_path):
    proxy = fault_proxy(s3_server)
    cache = store_env(proxy)
    outcome = train([f"s3://{bucket}/pack", *RUN, "--workers", "1", "--epochs", "2", "--checkpoints-path",
                     str(tmp_path / "ckpt")])
    assert outcome.final_step == 6
    same_weights(tmp_path / "ckpt", disk_run)
    cached = sorted(p.name.split("-", 1)[1] for p in cache.iterdir() if p.name.endswith(".tar"))
    assert cached == sorted([*(f"shard-{k:06d}.tar" for k in range(5)), *(f"shard-{k:06d}.tar" for k in range(2))])
    read, tars = proxy.stats()["bytes"], sum(p.stat().st_size for p in (shards / "pack").rglob("*.tar"))
    assert tars <= read <= 1.1 * store_bytes(shards / "pack")  # two epochs, each byte once (and a few listings)
    scored = command(["evaluate", str(tmp_path / "ckpt" / "last.pt"), f"s3://{bucket}/pack", "--workers", "0",
                      "--amp", "none"])  # the pack's root: its val split, as training took it
    assert scored.returncode == 0, scored.stderr
    row = json.loads(scored.stdout.strip().splitlines()[-1])
    history = load_checkpoint(tmp_path / "ckpt" / "last.pt")["history"][-1]
    assert (row["images"], row["val_as_trained"]) == (35, True), scored.stderr
    assert row["top1"] == pytest.approx(history["val_top1"])


def test_foreign_shards_in_s3_are_indexed_by_ranged_reads_once_and_train_as_on_disk(
        s3_server, bucket, shards, fault_proxy, store_env, tmp_path):
    proxy = fault_proxy(s3_server)
    store_env(proxy)
    on_disk, from_store = tmp_path / "disk", tmp_path / "store"
    wds = [str(shards / "wds" / "train" / "part-{0000..0003}.tar"), "--val-path"]
    train([*wds, str(shards / "wds" / "val"), *RUN, "--workers", "0", "--epochs", "1", "--checkpoints-path",
           str(on_disk)])
    url = f"s3://{bucket}/wds"
    train([f"{url}/train/part-{{0000..0003}}.tar", "--val-path", f"{url}/val", *RUN, "--workers", "0", "--epochs", "1",
           "--checkpoints-path", str(from_store)])
    same_weights(from_store, on_disk)
    index = tar_shards.read_index(str(from_store / "index-train-shards.npz"), "x", "train",
                                  [f"{url}/train/part-{k:04d}.tar" for k in range(4)], packed=False)
    assert index is not None and index.etags is not None and len(index) == 4 * 24
    first = proxy.stats()["requests"]
    proxy.reset_stats()
    open_source(f"{url}/train/part-{{0000..0003}}.tar", "train", str(from_store))  # the kept index: no walk
    assert proxy.stats()["requests"] <= 2 < first, [(r["method"], r["path"], r["status"]) for r in proxy.requests()]


def test_a_pack_over_https_trains_bitwise_as_on_disk(shards, disk_run, range_http_server, store_env, tmp_path):
    server = range_http_server(shards)
    store_env(server)
    train([f"{server.url}/pack", *RUN, "--workers", "1", "--epochs", "2", "--checkpoints-path", str(tmp_path)])
    same_weights(tmp_path, disk_run)


def test_503s_and_resets_cost_retries_not_the_run(s3_server, bucket, disk_run, fault_proxy, store_env, tmp_path):
    proxy = fault_proxy(s3_server)
    store_env(proxy, cap_gb=str(200_000 / 2 ** 30))  # two shards fit: shards are fetched again and again
    proxy.fail_next(3, "503")
    threading.Timer(2.0, proxy.fail_next, (3, "reset")).start()  # in the middle of the run
    train([f"s3://{bucket}/pack", *RUN, "--workers", "1", "--epochs", "2", "--checkpoints-path", str(tmp_path)])
    assert proxy.stats()["faults"] == 6
    same_weights(tmp_path, disk_run)


def test_a_store_that_stays_away_ends_the_run_keeping_its_checkpoint_and_resume_is_exact(
        s3_server, bucket, disk_run, fault_proxy, store_env, tmp_path):
    proxy = fault_proxy(s3_server)
    store_env(proxy, timeout="3", cap_gb=str(100_000 / 2 ** 30))  # one shard fits: epoch 2 must read the store
    args = [f"s3://{bucket}/pack", *RUN, "--workers", "1", "--epochs", "2", "--checkpoints-path", str(tmp_path)]

    def stall_after_the_first_save(trainer) -> None:
        save = trainer.checkpointer.save

        def saved_then_stall(*a, **k):
            save(*a, **k)
            proxy.set_mode("stall")

        trainer.checkpointer.save = saved_then_stall

    with pytest.raises(StoreUnavailable) as raised:  # met by a loader worker: its line is the one a user reads
        train(args, before_fit=stall_after_the_first_save)
    assert re.match(rf"the store did not answer for s3://{bucket}/pack/\S+ for 3 s", one_line(raised.value))
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 3  # epoch 1's checkpoint, whole
    proxy.set_mode("pass")
    train([*args, "--resume"])
    same_weights(tmp_path, disk_run)


def test_the_server_killed_and_restarted_mid_epoch_costs_a_pause_not_the_run(
        fresh_s3_server, shards, disk_run, fault_proxy, warm_python, tmp_path):
    fresh_s3_server.put_folder(shards / "pack", BUCKET, "pack")
    proxy = fault_proxy(fresh_s3_server)  # resets while the server is down and while its objects are put back
    env = child_env(**proxy.env(), IMAGENET_ELASTIC_STORE_CACHE=str(tmp_path / "cache"),
                    IMAGENET_ELASTIC_STORE_CACHE_GB=str(100_000 / 2 ** 30), IMAGENET_ELASTIC_STORE_TIMEOUT="60")
    cmd = python_cmd(f"s3://{BUCKET}/pack", *RUN, "--workers", "1", "--epochs", "2", "--checkpoints-path",
                     str(tmp_path / "ckpt"), python=warm_python)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in proc.stdout:
        output.append(line)
        if "epoch 1/2 step 2/" in line:
            proxy.set_mode("reset")
            fresh_s3_server.kill()
            time.sleep(2)  # the run goes on meanwhile: its output waits in the pipe
            fresh_s3_server.restart()  # from this thread, which outlives the server (store_servers)
            proxy.set_mode("pass")
    assert proc.wait(120) == 0, "".join(output)
    same_weights(tmp_path / "ckpt", disk_run)


@pytest.mark.multiprocess
def test_a_sigkilled_torchrun_job_from_s3_resumes_at_another_world_size_bitwise(
        s3_server, bucket, disk_run, store_env, warm_python, tmp_path):
    store_env(s3_server)
    ckpt = tmp_path / "ckpt"
    args = [f"s3://{bucket}/pack", *RUN, "--workers", "1"]
    cmd = torchrun_cmd(2, *args, "--epochs", "1", "--checkpoint-interval", "1", "--checkpoints-path", str(ckpt),
                       restarts=1)
    code, output = run_and_kill(cmd, when="epoch 1/1 step 2/", victim=torchrun_worker(1),
                                env=child_env(PYTHON_EXEC=warm_python))  # ranks: forks of the warm python
    assert code == 0 and "every rank has the same data" in output, output
    train([*args, "--epochs", "2", "--checkpoints-path", str(ckpt), "--resume"])
    final = load_checkpoint(ckpt / "last.pt")
    assert [r["world_size"] for r in final["history"]] == [2, 1]
    same_weights(ckpt, disk_run)


def test_a_pack_written_to_gcs_trains_bitwise_as_on_disk_and_a_missing_bucket_is_one_line(
        gcs_server, image_folder, shards, disk_run, store_env, tmp_path):
    """gs:// through gcsfs against a GCS emulator: `pack` uploads, training reads the pack back through the cache."""
    store_env(gcs_server)
    gcs_server.create_bucket("packed-gcs")
    packed = command(["pack", str(image_folder), "gs://packed-gcs/pack", "--shard-size", "20"])
    assert packed.returncode == 0, packed.stderr
    train(["gs://packed-gcs/pack", *RUN, "--workers", "1", "--epochs", "2", "--checkpoints-path", str(tmp_path / "ck")])
    same_weights(tmp_path / "ck", disk_run)
    missing = command(["gs://no-such-bucket/pack", *RUN, "--checkpoints-path", str(tmp_path / "none")])
    assert missing.returncode == 2 and "gs://no-such-bucket/pack does not exist" in missing.stderr, missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1 and not (tmp_path / "none").exists()


def test_bad_store_input_is_one_line_before_any_work(s3_server, bucket, store_env, monkeypatch, tmp_path):
    store_env(s3_server, timeout="2")
    cases = {"s3://no-such-bucket/pack": "does not exist",
             f"s3://{bucket}/wds/train/part-{{0000..0009}}.tar": r"shard s3://imagenet/wds/train/part-0004\.tar does",
             f"parquet:s3://{bucket}/pack": "no parquet: source reads a store"}
    for data, says in cases.items():
        finished = command([data, *RUN, "--val-path", f"s3://{bucket}/pack/val", "--checkpoints-path",
                            str(tmp_path / "ckpt")])
        assert finished.returncode == 2 and re.search(says, finished.stderr), (data, finished.stderr)
        assert len(finished.stderr.strip().splitlines()) == 1 and not (tmp_path / "ckpt").exists()
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens on the discard port
    unreachable = command([f"s3://{bucket}/pack", *RUN, "--checkpoints-path", str(tmp_path / "ckpt")])
    assert unreachable.returncode == 69 and "did not answer" in unreachable.stderr, unreachable.stderr
    said = unreachable.stderr.strip().splitlines()  # the wait's warning at once, then the error at the bound
    assert [line.split(":")[0] for line in said] == ["warning", "imagenet-elastic"], said
    assert "127.0.0.1" not in unreachable.stderr
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # moto then checks keys, and ours are no IAM user's
    with store_servers.S3Server(log_dir=tmp_path / "logs") as strict:
        store_env(strict, timeout="2")
        refused = command([f"s3://{bucket}/pack", *RUN, "--checkpoints-path", str(tmp_path / "ckpt")])
    assert refused.returncode == 2 and f"s3://{bucket}/pack: access refused" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "ckpt").exists()


def test_a_changed_object_is_refused_in_a_pack_and_indexed_again_in_foreign_shards(
        s3_server, shards, store_env, tmp_path):
    store_env(s3_server)
    s3_server.put_folder(shards, "changing")
    url = "s3://changing"
    open_source(f"{url}/wds/train/part-{{0000..0003}}.tar", "train", str(tmp_path)).keep(str(tmp_path))
    changed = bytearray((shards / "wds" / "train" / "part-0002.tar").read_bytes())
    changed[-2048] ^= 1  # one byte near its end: the same size, another ETag
    s3_server.put_bytes(bytes(changed), "changing", "wds/train/part-0002.tar")
    again = open_source(f"{url}/wds/train/part-{{0000..0003}}.tar", "train", str(tmp_path))
    (note,) = again.notes  # one note: the shard that changed, and that it was indexed again
    assert "\n" not in note
    assert_names(note, f"{url}/wds/train/part-0002.tar", "changed", "indexed again")
    s3_server.put_bytes(b"x" * 100, "changing", "pack/train/shard-000003.tar")
    with pytest.raises(UserError, match=rf"^shard {url}/pack/train/shard-000003\.tar has 100 bytes but its index"):
        open_source(f"{url}/pack/train", "train", None)


def test_pack_writes_to_a_store_the_bytes_of_a_local_pack_and_an_interrupted_upload_is_refused_until_continued(
        s3_server, image_folder, shards, disk_run, store_env, monkeypatch, tmp_path):
    cache = store_env(s3_server)
    s3_server.create_bucket("packed")
    out = "s3://packed/imagenet-pack"
    real_write, calls, failed = object_store.write_file, [], []

    def write_then_fail(local, url, timeout):  # the store goes away at the eighth upload of the first run
        calls.append(url)
        if len(calls) == 8 and not failed:
            failed.append(url)
            raise StoreUnavailable(f"the store did not answer for {url}")
        real_write(local, url, timeout)

    monkeypatch.setattr(object_store, "write_file", write_then_fail)
    first = command(["pack", str(image_folder), out, "--shard-size", "20"])
    assert first.returncode == 69 and len(calls) == 8, first.stderr
    client = s3_server.client()
    listed = {o["Key"] for o in client.list_objects_v2(Bucket="packed")["Contents"]}
    assert len(listed) == 1 + 7 and max(listed) == "imagenet-pack/val/shard-000000.tar"  # and classes.txt, 5 train
    record = json.loads(client.get_object(Bucket="packed", Key="imagenet-pack/pack.json")["Body"].read())
    assert record["complete"] is False  # sent first: what was sent is not yet a pack
    trained = command([out, *RUN, "--checkpoints-path", str(tmp_path / "ckpt")])
    scored = command(["evaluate", str(disk_run / "last.pt"), out, "--workers", "0", "--amp", "none"])
    for refused in (trained, scored):  # train's split, then evaluate's val split: neither has its index yet
        assert refused.returncode == 2, refused.stderr
        assert_names(single_line(refused.stderr), f"{out}/pack.json", f"imagenet-elastic pack {image_folder} {out}")
    assert not (tmp_path / "ckpt").exists()
    calls.clear()
    again = command(["pack", str(image_folder), out, "--shard-size", "20"])
    assert again.returncode == 0, again.stderr
    local = shards / "pack"
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert len(calls) == len(files) - 7  # what the first run had sent is not sent again
    for name in files:
        body = client.get_object(Bucket="packed", Key=f"imagenet-pack/{name}")["Body"].read()
        if name.endswith(tar_shards.INDEX_NAME):  # its shards' local mtimes and folder are the staging folder's
            ours, theirs = np.load(io.BytesIO(body)), np.load(local / name)
            for key in set(theirs.files) - {"mtimes", "location"}:
                assert np.array_equal(ours[key], theirs[key]), (name, key)
        elif name != "pack.json":  # which names the folders it was written in
            assert body == (local / name).read_bytes(), name
    assert not any(p.name.startswith("pack-") for p in cache.iterdir())  # the staging folder is gone
    assert len(open_source(f"{out}/train", "train", None)) == 96


@pytest.mark.parametrize("body", [b'{"complete": tr', b"[]"], ids=["cut short", "not an object"])
def test_pack_to_a_store_whose_pack_json_is_damaged_is_one_line_naming_the_object(
        s3_server, image_folder, store_env, body):
    store_env(s3_server)
    s3_server.create_bucket("damaged")
    s3_server.client().put_object(Bucket="damaged", Key="imagenet-pack/pack.json", Body=body)
    finished = command(["pack", str(image_folder), "s3://damaged/imagenet-pack", "--shard-size", "20"])
    assert finished.returncode == 2
    assert_names(single_line(finished.stderr), "s3://damaged/imagenet-pack/pack.json", "damaged", "remove it")
