"""Generate the Python gRPC stubs of proto/ into the shared package (conveyor.v1).

Run during setup (make setup); the output is not committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "common"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={OUT_DIR}",
            f"--pyi_out={OUT_DIR}", f"--grpc_python_out={OUT_DIR}", *protos]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    package_dir = OUT_DIR / "conveyor" / "v1"
    (package_dir / "__init__.py").write_text('"""Generated gRPC stubs of proto/conveyor/v1."""\n')
    print(f"generated {len(protos)} protos into {package_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
