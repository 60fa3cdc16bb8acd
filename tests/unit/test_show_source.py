"""show_source shows the real code, or the part of it that teaches: some methods of a class, or some lines."""
import pytest

from course_lib import source_of
from course_lib.io.cache import ShardCache


def test_only_shows_the_named_methods_under_the_class_line_and_names_the_rest():
    src = source_of(ShardCache, only=["put"])
    assert src.startswith("class ShardCache:") and "def put(self, key: str, data: bytes)" in src
    assert "def get_or_fetch" not in src and "# … and __init__" in src and "get_or_fetch" in src.splitlines()[-1]
    compile(src.replace("# …", "#"), "<show_source>", "exec")        # still valid Python


def test_lines_keeps_a_slice_and_marks_the_cut():
    full = source_of(ShardCache.put).splitlines()
    part = source_of(ShardCache.put, lines=(2, 4)).splitlines()
    assert part[1:4] == full[1:4] and part[0] == "# … 1 line(s) above" and part[-1].startswith("# …")


def test_bad_requests_say_what_exists():
    with pytest.raises(ValueError, match="defines no nothing; it defines"):
        source_of(ShardCache, only="nothing")
    with pytest.raises(ValueError, match="has lines 1 to"):
        source_of(ShardCache.put, lines=(0, 10_000))


def test_several_ranges_keep_each_slice_in_order_and_mark_every_cut():
    full = source_of(ShardCache.put).splitlines()
    n = len(full)
    assert n >= 6
    part = source_of(ShardCache.put, lines=[(1, 2), (4, 5)]).splitlines()
    assert part[:2] == full[:2] and part[2] == "# … 1 line(s) left out" and part[3:5] == full[3:5]
    assert part[5:] == ([f"# … {n - 5} line(s) below"] if n > 5 else [])
    with pytest.raises(ValueError, match="in order, not overlapping"):
        source_of(ShardCache.put, lines=[(3, 4), (2, 5)])
