"""Put this folder on PYTHONPATH to run a service as its container does, without
torch: transformers then finds no torch and never imports it."""

import sys

sys.modules["torch"] = None  # import torch raises ImportError; find_spec returns None
