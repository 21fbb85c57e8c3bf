"""The progress bar on a stream that is not a terminal."""

from __future__ import annotations

from specdecode.progress import ProgressBar


def test_progress_bar_on_a_plain_stream_prints_one_summary(tmp_path):
    with open(tmp_path / "err.txt", "w") as stream:
        bar = ProgressBar(3, stream)
        for _ in range(3):
            bar.update("x")
        bar.message("hello")
        bar.close()
    assert (tmp_path / "err.txt").read_text().splitlines()[0] == "hello"
    assert (tmp_path / "err.txt").read_text().splitlines()[1].startswith("ran 3/3 timed calls")
