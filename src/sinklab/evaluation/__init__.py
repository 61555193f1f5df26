"""Measuring streams: perplexity over long texts (:mod:`.stream`, ``sinklab eval-stream``) and what a bounded stream
forgets or keeps (:mod:`.quality`: fact recall, endless generation, many prompts in one chat) and
fitting an ``auto`` plan's budgets on a calibration text (:mod:`.calibration`)."""
