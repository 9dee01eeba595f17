"""Speculation bookkeeping in the core: the drafts of each sequence and the adaptive draft length."""
