"""What is computed across sites: the outer step (DiLoCo), its per-step data-parallel baseline,
and `NoOuter` for a single-site run. Who takes part is zeroband/membership/."""
