"""show_source shows the real code, or the part of it that teaches: some methods of a class, chosen by name."""
import inspect

import pytest

import course_lib
from course_lib import source_of
from course_lib.io.cache import ShardCache
from course_lib.memopt.precision import Format


def test_only_shows_the_named_methods_under_the_class_line_and_names_the_rest():
    src = source_of(ShardCache, only=["put"])
    assert src.startswith("class ShardCache:") and "def put(self, key: str, data: bytes)" in src
    assert "def get_or_fetch" not in src and "# … and __init__" in src and "get_or_fetch" in src.splitlines()[-1]
    compile(src.replace("# …", "#"), "<show_source>", "exec")        # still valid Python


def test_a_dataclass_keeps_its_decorator_and_fields_and_properties_are_chosen_by_name():
    src = source_of(Format, only=["bits", "max"])
    lines = src.splitlines()
    assert lines[:2] == ["@dataclass(frozen=True)", "class Format:"]
    assert "    mantissa_bits: int" in lines and "    finite_only: bool = False" in lines     # the fields
    assert "def bits(self)" in src and "def max(self)" in src and "def bias(self)" not in src
    left_out = lines[-1]
    assert left_out.startswith("    # … and") and "bias" in left_out and "__init__" not in left_out  # not @dataclass's
    assert src.count("@property") == 2                 # each shown property once, the next one's decorator not at all
    compile(src.replace("# …", "#"), "<show_source>", "exec")


def test_bad_requests_say_what_exists():
    with pytest.raises(ValueError, match="defines no method nothing; it defines"):
        source_of(ShardCache, only="nothing")
    with pytest.raises(TypeError, match="needs a class"):
        source_of(source_of, only="x")


def test_there_is_no_cut_by_line_number():
    """An edit above a line-number cut silently changes what a lecture shows: the option does not exist."""
    for fn in (source_of, course_lib.show_source):
        assert "lines" not in inspect.signature(fn).parameters
