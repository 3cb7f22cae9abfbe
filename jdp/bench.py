"""`python -m jdp.bench`: the benchmark is `jdp.perf.bench` (`--predict`: `jdp.perf.predict`)."""

if __name__ == "__main__":
    from jdp.perf.bench import main

    raise SystemExit(main())
