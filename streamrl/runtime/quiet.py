"""Library log noise that says nothing about a run, turned down for the CLI and every process.

Called by the console script, the spawned trainer ranks and ``streamrl sim validate``: kept apart
from ``streamrl.cli.main`` so that none of them has to import the command line.
"""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """Keep stderr for our own progress (also called by spawned trainer ranks)."""
    # These libraries otherwise draw progress bars of their own.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    import datasets

    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", message=".*treespec.*", category=Warning)


def quiet_lightning(verbose: bool = False) -> None:
    """Lightning at WARNING level (also called by spawned trainer ranks); ``verbose`` leaves
    its information lines on (``--verbose``)."""
    # Lightning's start-up banners ("GPU available", install tips) say nothing about this run.
    # Its import sets its loggers to INFO, so this runs after the import.
    import lightning.pytorch  # noqa: F401

    level = logging.INFO if verbose else logging.WARNING
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(level)
    # A KL reference policy is frozen in eval mode on purpose.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
