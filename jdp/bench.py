"""`python -m jdp.bench`: the benchmark is `jdp.perf.bench` (`--predict`: `jdp.perf.predict`)."""

if __name__ == "__main__":
    from jdp.metrics import console_may_close
    from jdp.perf.bench import main

    with console_may_close(quiet=True):  # `| head` ends it as any command's, without a BrokenPipeError traceback
        raise SystemExit(main())
