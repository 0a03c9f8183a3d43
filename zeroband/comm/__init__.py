"""How a pseudo-gradient crosses the WAN."""
