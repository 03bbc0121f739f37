"""Slurm hostlist expansion: every format SLURM_JOB_NODELIST uses, malformed input, and scontrol where present."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from imagenet_elastic.errors import UserError
from imagenet_elastic.launch.hostlist import MAX_HOSTS, expand_hostlist, first_host

VALID = [
    ("plain", "node1", ["node1"]),
    ("comma_list", "a,b,c", ["a", "b", "c"]),
    ("simple_range", "n[1-2]", ["n1", "n2"]),
    ("range", "n[1-4]", ["n1", "n2", "n3", "n4"]),
    ("single_in_brackets", "n[7]", ["n7"]),
    ("padded", "gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
    ("padded_across_decade", "n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("unpadded_across_decade", "n[9-11]", ["n9", "n10", "n11"]),
    ("padding_outgrown", "n[98-100]", ["n98", "n99", "n100"]),
    ("comma_in_brackets", "gpu-a[01-03,07]", ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a07"]),
    ("mixed_top_level", "gpu-a[01-03,07],gpu-b9", ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a07", "gpu-b9"]),
    ("cartesian", "rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("cartesian_lists", "r[1,3]n[0-1]", ["r1n0", "r1n1", "r3n0", "r3n1"]),
    ("dashed", "gpu-b9", ["gpu-b9"]),
    ("dotted", "node-1.cluster.local", ["node-1.cluster.local"]),
    ("suffix", "n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("range_then_domain", "n[1-2].cluster.local", ["n1.cluster.local", "n2.cluster.local"]),
    ("brackets_only", "[1-2]", ["1", "2"]),
    ("whitespace", " a , n[1-2] ,\tb\n", ["a", "n1", "n2", "b"]),
    ("order_kept", "z,a,n[3,1-2]", ["z", "a", "n3", "n1", "n2"]),
    ("duplicates_kept", "a,a,n[1,1]", ["a", "a", "n1", "n1"]),
    ("several_ranges", "n[1-2,5-6],m[10]", ["n1", "n2", "n5", "n6", "m10"]),
]


@pytest.mark.parametrize(("expr", "expected"), [(e, x) for _, e, x in VALID], ids=[i for i, _, _ in VALID])
def test_expand(expr: str, expected: list[str]) -> None:
    assert expand_hostlist(expr) == expected
    assert first_host(expr) == expected[0]


@pytest.mark.parametrize(
    ("expr", "count", "first", "last"),
    [("gpu[0001-5000]", 5000, "gpu0001", "gpu5000"),
     ("n[00000-99999]", 100_000, "n00000", "n99999"),
     ("r[1-100]n[001-100]", 10_000, "r1n001", "r100n100")],
    ids=["padded_5000", "padded_at_limit", "product_10000"],
)
def test_large(expr: str, count: int, first: str, last: str) -> None:
    hosts = expand_hostlist(expr)
    assert (len(hosts), hosts[0], hosts[-1]) == (count, first, last)
    assert len(set(hosts)) == count


MALFORMED = [
    ("empty", "", "empty"),
    ("blank", "   ", "empty"),
    ("unclosed", "n[1-3", "never closed"),
    ("unopened", "n1-3]", "without a matching '['"),
    ("extra_close", "n[1-3]]", "without a matching '['"),
    ("nested", "n[1-[2-3]]", "nested"),
    ("empty_brackets", "n[]", "empty brackets"),
    ("descending", "n[5-2]", "ends below its start"),
    ("letters", "n[a-c]", "integer bounds"),
    ("half_open", "n[1-]", "integer bounds"),
    ("negative", "n[-1]", "integer bounds"),
    ("double_dash", "n[1-2-3]", "integer bounds"),
    ("empty_entry_in_brackets", "n[1,,3]", "empty entry"),
    ("double_comma", "a,,b", "empty item"),
    ("trailing_comma", "a,b,", "empty item"),
    ("leading_comma", ",a", "empty item"),
    ("inner_whitespace", "a b", "whitespace"),
    ("too_many", "n[0-100000]", f"more than {MAX_HOSTS}"),
    ("too_many_product", "a[1-1000]b[1-1000]", f"more than {MAX_HOSTS}"),
    ("too_many_total", "n[1-60000],m[1-60000]", f"more than {MAX_HOSTS}"),
]


@pytest.mark.parametrize(("expr", "problem"), [(e, p) for _, e, p in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_malformed(expr: str, problem: str) -> None:
    with pytest.raises(UserError) as info:
        expand_hostlist(expr)
    message = str(info.value)
    assert repr(expr) in message
    assert problem in message
    assert "\n" not in message
    with pytest.raises(UserError):
        first_host(expr)


# No text after the last bracket group ("n[1-2]-ib"): Slurm 22.05 rejects it ("Invalid hostlist") and never writes it
# in a nodelist, while expand_hostlist accepts it on purpose. Text between groups ("n[1-2]-ib[1]") Slurm accepts.
SCONTROL_EXPRS = ["node1", "a,b,c", "n[1-2]", "n[7]", "gpu[001-003]", "n[08-11]", "n[98-100]", "n[01-100]",
                  "gpu-a[01-03,07],gpu-b9", "rack[1-2]-n[1-2]", "r[1,3]n[0-1]", "n[1-2]-ib[1]", "node-1.cluster.local",
                  "z,a,n[3,1-2]", "a,a", "n[1,1]", "[1-2]", "gpu[0001-0250]"]


def _scontrol_env(scontrol: str, tmp_path) -> dict[str, str]:
    """An environment in which `scontrol show hostnames` runs: the machine's own Slurm config if it works,
    else a two-line config (scontrol refuses SLURM_CONF=/dev/null: "ClusterName needs to be specified")."""
    minimal = tmp_path / "slurm.conf"
    minimal.write_text("ClusterName=test\nSlurmctldHost=localhost\n")
    tried = []
    for conf in (os.environ.get("SLURM_CONF"), "/dev/null", str(minimal)):
        env = dict(os.environ)
        if conf is not None:
            env["SLURM_CONF"] = conf
        result = subprocess.run([scontrol, "show", "hostnames", "n[1-2]"], capture_output=True, text=True, env=env,
                                timeout=30)
        if result.returncode == 0 and result.stdout.split() == ["n1", "n2"]:
            return env
        tried.append(f"SLURM_CONF={conf}: {' '.join(result.stderr.split())[:200]}")
    pytest.skip("scontrol cannot run without a usable Slurm config; tried " + "; ".join(tried))


def test_matches_scontrol(tmp_path) -> None:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        pytest.skip("scontrol is not installed on this machine")
    env = _scontrol_env(scontrol, tmp_path)
    for expr in SCONTROL_EXPRS:
        # scontrol exits 0 even for an invalid hostlist, so its stderr must be empty too.
        result = subprocess.run([scontrol, "show", "hostnames", expr], capture_output=True, text=True, env=env,
                                timeout=30)
        assert result.returncode == 0 and not result.stderr.strip(), (expr, result.stderr)
        assert expand_hostlist(expr) == result.stdout.split(), expr
