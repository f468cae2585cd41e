"""Titan: decode Mixture-of-Experts models whose experts do not all fit in fast memory."""

import os

# Titan never downloads: models are pinned and cached, or built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

__version__ = "0.1.0"
