"""Generate docs/state-diagram.md (mermaid) from the route-session transition table.

python scripts/gen_state_diagram.py            # write docs/state-diagram.md
python scripts/gen_state_diagram.py --print    # print the document instead
python scripts/gen_state_diagram.py --check    # exit 1 if the committed file is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "state-diagram.md"


def render() -> str:
    """The document, generated from ``dgr_session.machine.TRANSITIONS``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from dgr_session.machine import state_diagram_markdown

    return state_diagram_markdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print instead of writing")
    mode.add_argument("--check", action="store_true", help="fail if the file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.print:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(
                f"{TARGET.relative_to(ROOT)} is stale: run {Path(__file__).name}", file=sys.stderr
            )
            return 1
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
