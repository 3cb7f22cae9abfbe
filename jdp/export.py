"""`python -m jdp.export --workdir W --out params.npz`: the command is `jdp.cli.export` (in Python:
`jdp.export_params`)."""

if __name__ == "__main__":
    from jdp.cli.export import main

    raise SystemExit(main())
