"""Shared by the CLI tests: the flags of one single release, and the check that a command failed
with exactly one ``dpmf COMMAND: error:`` line and no traceback."""

SINGLE = ["--scheme", "single_release", "--dataset-size", "1000", "--batch-size", "100", "--steps", "1"]


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"dpmf {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]
