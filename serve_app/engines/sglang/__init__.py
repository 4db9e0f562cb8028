"""The SGLang 0.5.23 backend, one job per module: `args` (config tree -> server arguments,
sampling params, CLI spelling, runtime env), `checks` (start-up checks), `flags` (the vendored
flag table), `output` (SGLang's streamed dicts -> RequestOutput), `engine` (SGLangEngine).
Importers name the module they need; nothing is re-exported here."""
