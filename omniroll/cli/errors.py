"""The command line's two errors: `UserError` (what the user gave is wrong: exit 2) and `CommandFailed` (some work
failed after the rest was written: exit 1). `omniroll.cli.main` turns them into lines and exit codes; every command
module raises them (also importable as `omniroll.cli.UserError`)."""

from __future__ import annotations


class UserError(ValueError):
    """A problem in what the user gave (flag, config key, file): printed one line per entry of `problems`, exit 2."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class CommandFailed(RuntimeError):
    """Some of the work failed (what finished was written): one line per entry of `problems`, exit 1."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))
