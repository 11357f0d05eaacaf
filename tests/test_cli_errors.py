"""A directory given where a trace file is expected is named as one, with what is expected."""

from ascend_pool.cli import main


def test_a_directory_given_for_a_trace_is_named_as_one(tmp_path, capsys):
    # Before: "ascend-pool replay: FileNotFoundError: no trace file at '/the/dir'", as if the path
    # were mistyped, with nothing about what the command takes.
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{str(tmp_path)!r} is a directory; expected a trace file NAME.npz" in err, err
