"""The kit's error types, each reported as one line by `run.cli.main_guard` (exit code 2,
or 128 + the signal for `Interrupted`), and the one-line form of an exception's message.

A leaf: it imports nothing of the kit, so every layer can raise these.
"""


class UsageError(ValueError):
    """A bad flag combination, reported as one line."""


class DataError(ValueError):
    """A problem with the data or a data flag; the message is one user-facing line."""


class CheckpointError(Exception):
    """A checkpoint is missing, corrupt or partial, or does not fit the template."""


class WeightsError(UsageError):
    """A weights file (--init-from, vit_pure/weights/) that cannot be read or does not fit
    the model; the message is one line naming the file or key, and the shapes."""


class Interrupted(Exception):
    """SIGTERM / SIGINT stopped a run that had nowhere to save (no --ckpt-dir).

    `main_guard` prints the message and exits with 128 + the signal number (130 for
    SIGINT, 143 for SIGTERM), the shell's convention for "killed by this signal", so a
    wrapper or scheduler does not mistake the run for a finished one; a run that saved a
    checkpoint before it stopped exits with the same code.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__
