"""Build hook: generate the gRPC Python stubs from protos/ (never committed, never edited by hand)."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_stubs() -> None:
    from grpc_tools import protoc  # build requirement (pyproject [build-system])

    proto_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", *proto_files]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {proto_files}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
