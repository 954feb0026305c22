"""The speculation policy's settings: numbers only, read by its three parts (estimates.py,
decision.py, schedule.py). Why each default is what it is: docs/speculation.md."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Settings:
    max_depth: int
    verify_nodes: object = None      # depth -> the verify graph a round runs now: its size, or (device, size)
    verify_graphs: object = None     # max depth -> every depth's verify_nodes answer at once
    # estimates
    window: int = 8                  # measurements each cost's median is taken over
    keep: float = 0.875              # per round or guess, how much of the old acceptance evidence stays
    runs: bool = True                # two rates (p, q); False: one rate over every draft (geometric)
    run_prior_weight: float = 4.0    # at a far context q's evidence shrinks to this many drafts
    charge_switches: bool = True     # a probe's budget also pays for the cold steps around it
    # decision
    margin: float = 1.0              # speculate when its rate beats plain decoding's by this factor
    hysteresis: float = 0.2          # ... and by (1 + this) more to switch from plain decoding
    # schedule: probes while plain decoding wins
    probe_every: int = 8             # plain steps before the first probe (two rounds)
    max_probe_every: int = 64        # ... the interval doubling up to this while probes lose
    probe_budget: float = 0.05       # probes cost at most this share of the plain decoding between them
    max_budget_interval: int = 1024  # plain steps between probes where no round could pay
    # schedule: refreshes of the decode cost while rounds win
    refresh_every: int = 16          # rounds between refreshes (2, 4, 8, ... up to this)
    refresh_steps: int = 4           # plain steps a refresh runs (the last is near steady)
    wide_margin: float = 1.5         # rounds this far ahead of plain decoding refresh only every
    max_refresh_every: int = 64      # ... up to this many rounds
    # schedule: the drafter's scored guesses
    guessing: bool = False           # the drafter scores its guesses (set by the generation loop)
    guess_every: int = 32            # plain steps between guess calls
    guesses_per_catch_up: int = 8    # the last this many guesses scored (keep^8 = 0.34: older weigh little)
    max_guess_every: int = 256       # ... the interval doubling up to this while the guesses say plain
    guess_budget: float = 0.02       # guess calls cost at most this share of the plain decoding between them
    guess_near: float = 0.85         # guesses that put rounds within this of plain's rate still probe
    plain_sample_every: int = 8      # while no round could pay, one plain step in this many is timed
