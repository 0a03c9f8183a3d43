"""Operator tools behind the `zeroband` command: launch sites on one machine, plan WAN cost, report runs."""
