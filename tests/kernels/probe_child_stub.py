"""A stand-in probe child for ``probe_stages_in_subprocess``'s tests: prints the stages listed in
``PROBE_STUB_PASSES`` (``|``-separated), one per line, then dies as a driver fault would (exit 3)."""

if __name__ == "__main__":
    import os
    import sys

    for stage in filter(None, os.environ.get("PROBE_STUB_PASSES", "").split("|")):
        print(stage, flush=True)
    print("a fault in the next probe", file=sys.stderr)
    sys.exit(3)
