"""Flower's SuperNode with its fixed waits shortened: ``python -m fedlt.engine.flower_supernode ARGS``.

Every argument is ``flower-supernode``'s own, and the node is Flower's; only its 3 s idle wait, its
0.5 s checks for a reply and its 1 s first back-off of object pulls are shortened
(:mod:`fedlt.engine.flower_waits`), at the cost of asking the SuperLink every ``--poll`` seconds while
idle. ``fedlt deploy`` starts its SuperNodes this way; a site can start Flower's ``flower-supernode``
instead, with Flower's waits.
"""

from __future__ import annotations

import argparse
import sys

from fedlt.engine.flower_waits import SUPERNODE_POLL_S, cap_supernode_waits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedlt.engine.flower_supernode", add_help=False,
        description="flower-supernode with its fixed waits shortened; every other argument is flower-supernode's "
                    "own (--help: this text, then flower-supernode's)")
    parser.add_argument("--poll", type=float, default=SUPERNODE_POLL_S,
                        help=f"seconds between the idle SuperNode's requests for messages and between its checks for "
                             f"a reply (default {SUPERNODE_POLL_S:g}; Flower's own: 3 and 0.5)")
    ours, theirs = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "--help" in theirs or "-h" in theirs:
        parser.print_help()
        print()
    if not 0 < ours.poll <= 3:
        print(f"python -m fedlt.engine.flower_supernode: error: --poll={ours.poll:g} is not in (0, 3] seconds; give "
              f"e.g. --poll {SUPERNODE_POLL_S:g}", file=sys.stderr)
        return 2
    from flwr.supernode.cli import flower_supernode

    cap_supernode_waits(ours.poll)
    sys.argv = ["flower-supernode", *theirs]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
