"""One-line errors: what a user sees of an error, also when a DataLoader worker re-raised it."""

from __future__ import annotations

import sys

import pytest

from imagenet_elastic.errors import CorruptImageError, UserError, first_line, one_line, report

WORKER_MESSAGE = (
    "Caught CorruptImageError in DataLoader worker process 0.\n"
    "Original Traceback (most recent call last):\n"
    '  File "/site-packages/torch/utils/data/_utils/worker.py", line 349, in _worker_loop\n'
    "    data = fetcher.fetch(index)\n"
    "  ...\n"
    "imagenet_elastic.errors.CorruptImageError: cannot decode image file /x/y.jpg: broken"
)


# ----------------------------------------------------------------------------- one_line

def test_one_line_strips_a_module_qualified_class_prefix_from_a_worker_reraise():
    assert one_line(CorruptImageError(WORKER_MESSAGE)) == "cannot decode image file /x/y.jpg: broken"


def test_one_line_strips_a_bare_class_prefix_from_a_worker_reraise():
    message = WORKER_MESSAGE.replace("imagenet_elastic.errors.CorruptImageError", "CorruptImageError")
    assert one_line(CorruptImageError(message)) == "cannot decode image file /x/y.jpg: broken"


def test_one_line_keeps_a_last_line_of_another_class_whole():
    message = WORKER_MESSAGE.replace("imagenet_elastic.errors.CorruptImageError", "other.NotMyError")
    assert one_line(CorruptImageError(message)) == "other.NotMyError: cannot decode image file /x/y.jpg: broken"


def test_one_line_does_not_strip_a_class_whose_name_only_ends_the_same():
    message = WORKER_MESSAGE.replace("imagenet_elastic.errors.CorruptImageError", "pkg.NotCorruptImageError")
    assert one_line(CorruptImageError(message)).startswith("pkg.NotCorruptImageError: ")


def test_one_line_of_a_torch_dataloader_reraise():
    # The same wrapping torch's DataLoader applies to a worker's exception, done in-process.
    from torch._utils import ExceptionWrapper

    try:
        raise CorruptImageError("cannot decode image file /data/a.jpg: truncated")
    except CorruptImageError:
        wrapper = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 3")
    with pytest.raises(CorruptImageError) as caught:
        wrapper.reraise()
    assert one_line(caught.value) == "cannot decode image file /data/a.jpg: truncated"


def test_one_line_joins_a_multi_line_message_without_traceback():
    assert one_line(UserError("  first line\n   second   line \n")) == "first line second line"
    assert one_line(UserError("plain")) == "plain"


def test_first_line_skips_blank_lines_and_names_a_silent_error():
    assert first_line(RuntimeError("\n  connection refused\nat 10.0.0.1")) == "connection refused"
    assert first_line(TimeoutError()) == "TimeoutError"


def test_rank_0_reports_for_all_and_other_ranks_only_what_is_theirs(capsys):
    report(UserError("--batch-size: bad"), rank=1)
    assert capsys.readouterr().err == ""
    report(UserError("--batch-size: bad"), rank=0)
    report(CorruptImageError("cannot decode image file /x.jpg"), rank=3)
    assert capsys.readouterr().err.splitlines() == ["imagenet-elastic: error: --batch-size: bad",
                                                    "imagenet-elastic: error: [rank 3] cannot decode image file /x.jpg"]
