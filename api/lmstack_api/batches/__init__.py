"""The OpenAI Batch API (`/v1/files`, `/v1/batches`) and its offline form (`lmstack batch run`).

- `store`: the state in `server.batch_dir`: a SQLite index of files, batches and finished lines,
  and the files themselves, written atomically.
- `lines`: reading an input file's lines and writing output / error lines in OpenAI's format.
- `dispatch`: one line through the server's own Litestar app, in process.
- `runner`: the server's background worker that runs batches, resumable after a crash.
- `routes`: the HTTP handlers.
- `offline`: `lmstack batch run`.
"""
