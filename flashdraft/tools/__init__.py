"""Tools around the engine: the benchmark (`bench`), the demo, and random-weight model shapes (`shapes`)."""
