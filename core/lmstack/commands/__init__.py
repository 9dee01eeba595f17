"""The CLI's commands beyond the stack's own (serve comes from lmstack-api, quantize and eval
from lmstack-calibrate): `generate`, `plugins`, `plan` (with its
`plan_*` modules), `new-plugin`, and the progress bar long commands
share. `lmstack.cli` parses the arguments and dispatches here."""
