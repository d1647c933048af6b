"""The `shardwise` command line: one module per subcommand."""
