"""Convert a model's tokenizer and config into the cache once, where torch is installed:
`python -m conveyor.common.prepare_model [MODEL]` (default smollm2-135m-instruct).

transformers reads GGUF files only with torch, which the tokenizer and detok services do
not install; their images run this in a build stage and ship the cache folder instead.
"""

from __future__ import annotations

import sys

from conveyor.common.models import load_config, load_tokenizer, resolve_model
from conveyor.common.settings import DEFAULT_MODEL


def main(argv: list[str]) -> int:
    source = resolve_model(argv[0] if argv else DEFAULT_MODEL)
    load_tokenizer(source)
    load_config(source)
    print(f"prepared {source.name} in {source.hf_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
