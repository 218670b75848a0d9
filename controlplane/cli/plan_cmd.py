"""`kvplane plan --batch FILE`: plan placements for one batch or a JSON list of batches.

stdout: one plan object (for one batch) or a list of plans in the same order, as JSON.
Batch schema: :mod:`controlplane.model.batch`; plan schema: :mod:`controlplane.model.plan`.

Recompute (issue 16, ``docs/recompute.md``): a batch whose ``profile`` has
``recompute_ms_per_token`` (number or one per layer, ms per recomputed token) and whose
``policy`` has ``max_recompute_ratio`` in (0, 1) lets the planner leave each request's first
``u`` blocks uncached and recompute them through layers ``< k``; such plans carry
``recompute_blocks`` and ``recompute_layers`` (per recomputing request) and ``transient_blocks``.
Without the two fields the input and output schemas are exactly as before.
Malformed input exits with code 2 and a message on stderr naming the field (e.g.
``requests[1].context_tokens: -3 is out of range (allowed >= 1)``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import structlog

from controlplane.model import Batch, SchemaError
from controlplane.planner import VICTIM_RULES, Planner

EXIT_BAD_INPUT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", required=True, help="JSON file: one batch object or a list; '-' = stdin. Optional profile.recompute_ms_per_token + policy.max_recompute_ratio in [0, 1) offer the recompute option (docs/recompute.md); plans then carry recompute_blocks, recompute_layers, transient_blocks")
    parser.add_argument("--time-budget-ms", type=float, default=None, help="planning time budget per batch in ms (default: 25%% of the predicted step)")
    parser.add_argument("--victim-rule", choices=VICTIM_RULES, default="largest", help="which request to pause when infeasible")
    parser.add_argument("--current-step", type=int, default=None, help="absolute step now; plans then carry expiry_step")
    parser.add_argument("--indent", type=int, default=None, help="pretty-print the JSON output")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="structlog JSON events go to stderr")


def configure_logging(level: str) -> None:
    """structlog JSON lines on stderr, so stdout carries only the plans."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def _load(path: str) -> Any:
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    return json.loads(text)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if args.time_budget_ms is not None and not args.time_budget_ms >= 0:
        print(f"--time-budget-ms: {args.time_budget_ms} is out of range (allowed >= 0)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        raw = _load(args.batch)
    except OSError as exc:
        print(f"--batch: cannot read {args.batch!r}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UnicodeDecodeError as exc:
        print(f"--batch: {args.batch!r} is not UTF-8 text (byte {exc.start}): expected JSON", file=sys.stderr)
        return EXIT_BAD_INPUT
    except json.JSONDecodeError as exc:
        print(f"--batch: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    many = isinstance(raw, list)
    items = raw if many else [raw]
    batches = []
    for i, item in enumerate(items):
        try:
            batches.append(Batch.from_dict(item))
        except SchemaError as exc:
            where = f"[{i}]." if many else ""
            print(f"invalid batch: {where}{exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    planner = Planner()
    plans = [
        planner.plan(
            b,
            time_budget_ms=args.time_budget_ms,
            victim_rule=args.victim_rule,
            current_step=args.current_step,
        ).to_dict()
        for b in batches
    ]
    json.dump(plans if many else plans[0], sys.stdout, indent=args.indent)
    sys.stdout.write("\n")
    return 0
