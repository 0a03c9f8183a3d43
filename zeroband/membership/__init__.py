"""Who is in the run: admission of sites into each generation, liveness, the round protocol and
the resume agreement. Keys and tags live in zeroband/trust/, store clients and servers in
zeroband/store/; this package sits above both and above zeroband/comm/."""
