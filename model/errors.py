"""The error classes of the project: an exception's class says whether it is the user's mistake, and its exit code.

Every user-facing error subclasses `UserError` and carries `exit_code`; anything else escaping an entry point is a
bug. These live in the model package so that `model/` stands alone; the training engine and the pipelines raise the
same classes. The engine's own subclasses (checkpoint, divergence, run lock, stop, store) are in
finetune/utils/errors.py, whose `run_main` turns every one into one `error: ...` line and the exit code.

    0    success
    1    a bug: any other exception (traceback printed; please report it)
    2    ConfigError: a setting is wrong (also a bad command line, from argparse)
    3    DataError: an input or run check failed (bad CSV, too few windows, non-finite loss, ...)
    4    PathError: a file, folder or Hub id does not exist (also FileNotFoundError & co, Hub lookup errors)
    5    RefusedError: the run would overwrite or lose earlier work (also FileExistsError)
    6    MissingExtraError: an optional dependency is missing (also ModuleNotFoundError of `OPTIONAL_MODULES`)
    75   TrainingStopped: stopped on SIGTERM / first Ctrl-C after saving; the same command resumes
    130  KeyboardInterrupt (a second Ctrl-C)"""

from __future__ import annotations

from collections.abc import Sequence

EXIT_OK = 0
EXIT_BUG = 1
EXIT_CONFIG = 2
EXIT_DATA = 3
EXIT_PATH = 4
EXIT_REFUSED = 5
EXIT_MISSING_EXTRA = 6
EXIT_STOPPED = 75  # EX_TEMPFAIL: a scheduler may requeue the job
EXIT_INTERRUPTED = 130

# Top-level module -> the extra of this package that installs it.
OPTIONAL_MODULES = {"qlib": "qlib", "tensorboard": "tensorboard", "holidays": "calendars", "optuna": "tune",
                    "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve"}
PACKAGE_NAME = "kronos-finetune"


class UserError(Exception):
    """A mistake the user can fix; shown as one `error: ...` message without a traceback. Base of the others."""

    exit_code: int = EXIT_DATA


class ConfigError(UserError, ValueError):
    """Invalid settings; `.problems` lists one `"yaml.key: what is wrong"` line per problem."""

    exit_code = EXIT_CONFIG

    def __init__(self, problems: Sequence[str], title: str = "Invalid configuration"):
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{title} ({n} problem{'s' if n != 1 else ''}):\n{lines}")


class DataError(UserError, ValueError):
    """The input data fails a check (missing column, too few rows, NaN, ...)."""

    exit_code = EXIT_DATA


class PathError(UserError, FileNotFoundError):
    """A file, folder or Hub id the settings name cannot be found."""

    exit_code = EXIT_PATH


class RefusedError(UserError):
    """The run stops rather than overwrite or lose earlier work (e.g. resuming with different settings)."""

    exit_code = EXIT_REFUSED


class TokenizerMismatchError(RefusedError, ValueError):
    """A predictor would be paired with other tokenizer weights than those it was trained with."""


class MissingExtraError(UserError, ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""

    exit_code = EXIT_MISSING_EXTRA

    @classmethod
    def for_module(cls, module: str, what: str = "this command") -> MissingExtraError:
        """The error for a missing `module` of `OPTIONAL_MODULES` (its extra is named in the message)."""
        extra = OPTIONAL_MODULES.get(module.split(".")[0], module)
        return cls(f"{what} needs the optional dependency '{module}', which is not installed; install it with: "
                   f"pip install '{PACKAGE_NAME}[{extra}]'  (from a checkout: pip install '.[{extra}]')")
