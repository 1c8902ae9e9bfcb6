"""Other libraries' console noise, off by default: every switch in one place; `--verbose` leaves them all on.

Our own lines (one per stage event, the stages' progress lines, errors, our warnings) are never touched.
What is turned off, as seen in `alignflow run configs/tiny.yaml`: transformers' "LOAD REPORT" tables and
its "Loading weights" / "Writing model shards" progress bars, DeepSpeed's logger ("Setting accelerator
to CPU", "Attempting to get learning rate from scheduler before it has started") and its "... built
successfully" print, MLflow's "Creating initial MLflow database tables..." and its run-link lines (REST
stores), vLLM's logger below ERROR, and Python warnings raised outside alignflow (setuptools, torch,
...). Prefect's INFO logs are off already (PREFECT_LOGGING_LEVEL=WARNING in alignflow/offline.py);
`set_verbose` turns them back on.

Two layers, because a stage is a separate process that may have imported a library before it knows its
spec: environment variables the libraries read at import (`QUIET_ENV`, set in this process and so
inherited by every stage process the flow starts), and `quiet()` for the libraries already imported.
`alignflow run --verbose` sets ALIGNFLOW_VERBOSE=1 instead, which the stage processes inherit. This
module imports no ML library: it reaches one only if it is already in `sys.modules`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator

VERBOSE_VAR = "ALIGNFLOW_VERBOSE"

# Read by each library when it is imported (setdefault: a value the user set wins).
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",  # LOAD REPORT tables are logged at warning level
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' tqdm bars follow huggingface_hub's switch
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # "View run ... at: http://..." on a REST store
    "PYTHONWARNINGS": "ignore",  # warnings at import time in child processes; quiet() lets ours through after
    # vLLM's INFO lines (~40 per engine start) and its "Chat template warmup failed" traceback, which it logs
    # as a warning on every start with skip_tokenizer_init (alignflow gives it token ids, never text).
    "VLLM_LOGGING_LEVEL": "ERROR",
}

# Loggers already configured by an import before quiet() ran: their level is raised. DeepSpeed sets its
# logger's level when it is imported, so it gets a filter, which survives that (it logs on that one logger).
_LOGGER_LEVEL = {"mlflow": logging.WARNING}
_LOGGER_FILTER = {"DeepSpeed": logging.ERROR}
# Python warnings raised from these modules are ours and stay on.
_OUR_MODULES = r"(alignflow|__main__)(\.|$)"


def verbose() -> bool:
    return os.environ.get(VERBOSE_VAR, "") not in ("", "0")


def set_verbose() -> None:
    """`--verbose`: leave every library's console output on, here and in the stage processes started from
    here.

    Call before alignflow.offline.set_offline_defaults, whose PREFECT_LOGGING_LEVEL=WARNING this overrides.
    """
    os.environ[VERBOSE_VAR] = "1"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")


def quiet() -> None:
    """Turn the noise off in this process and in the processes it starts, unless ALIGNFLOW_VERBOSE is set.

    Idempotent; the CLI calls it before it imports anything heavy, a stage process at the top of `stage_main`.
    """
    if verbose():
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name, level in _LOGGER_LEVEL.items():
        logging.getLogger(name).setLevel(level)
    for name, level in _LOGGER_FILTER.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _MinLevel) for f in logger.filters):
            logger.addFilter(_MinLevel(level))
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None:  # imported before this call: its import-time switches were missed
        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=_OUR_MODULES)  # inserted first, so it wins for our modules


@contextlib.contextmanager
def library_stdout() -> Iterator[None]:
    """Swallow what a library call prints to stdout (DeepSpeed's "op built successfully"), unless verbose.

    Stdout is where a stage's result line goes; a library has no business printing there.
    """
    if verbose():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class _MinLevel(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level
