"""The `fermoe` subcommands, one module a command (as vLLM's entrypoints/cli/): each has a NAME,
`add_parser(subparsers)`, which adds its parser, and `run(args)`; common.py holds what they
share. fermoe/cli.py builds the parser from them and dispatches."""
