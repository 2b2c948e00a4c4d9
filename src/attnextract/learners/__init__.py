"""The learners: one module per extraction method, each taking an oracle and returning
an :class:`attnextract.report.ExtractionResult`."""
