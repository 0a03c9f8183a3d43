"""Test-side code: fault injection and the chaos harness. Nothing in the production path imports it."""
