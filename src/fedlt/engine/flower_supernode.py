"""Flower's SuperNode with its fixed waits shortened: ``python -m fedlt.engine.flower_supernode ARGS``.

Every argument is ``flower-supernode``'s own, and the node is Flower's; only its 3 s idle wait, its
0.5 s checks for a reply and its 1 s first back-off of object pulls are shortened
(:mod:`fedlt.engine.flower_waits`), at the cost of asking the SuperLink every ``--poll`` seconds while
idle (``$FEDLT_SUPERNODE_POLL`` where the node is started for you). ``fedlt deploy`` starts its SuperNodes this way; a site can start Flower's ``flower-supernode``
instead, with Flower's waits.
"""

from __future__ import annotations

import argparse
import os
import sys

from fedlt.engine.flower_waits import SUPERNODE_POLL_S, cap_supernode_waits

#: the environment variable that sets ``--poll`` where the SuperNode is started for you (``fedlt deploy``)
POLL_ENV = "FEDLT_SUPERNODE_POLL"


def chosen_poll(given: str | None = None) -> float:
    """``--poll`` if ``given``, else ``$FEDLT_SUPERNODE_POLL``, else the default; a ValueError names the bad one."""
    where, raw = (("--poll", given) if given is not None else
                  (f"${POLL_ENV}", os.environ[POLL_ENV]) if os.environ.get(POLL_ENV) else ("--poll", str(SUPERNODE_POLL_S)))
    try:
        poll = float(raw)
    except ValueError:
        poll = float("nan")
    if not 0 < poll <= 3:  # NaN too
        raise ValueError(f"{where}={raw} is not a number of seconds in (0, 3]; give e.g. {where}={SUPERNODE_POLL_S:g}")
    return poll


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedlt.engine.flower_supernode", add_help=False,
        description="flower-supernode with its fixed waits shortened; every other argument is flower-supernode's "
                    "own (--help: this text, then flower-supernode's)")
    parser.add_argument("--poll", help=f"seconds between the idle SuperNode's requests for messages and between its "
                                       f"checks for a reply (default: ${POLL_ENV}, else {SUPERNODE_POLL_S:g}; Flower's "
                                       "own: 3 and 0.5)")
    ours, theirs = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "--help" in theirs or "-h" in theirs:
        parser.print_help()
        print()
    try:
        poll = chosen_poll(ours.poll)
    except ValueError as err:
        print(f"python -m fedlt.engine.flower_supernode: error: {err}", file=sys.stderr)
        return 2
    from flwr.supernode.cli import flower_supernode

    cap_supernode_waits(poll)
    sys.argv = ["flower-supernode", *theirs]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
