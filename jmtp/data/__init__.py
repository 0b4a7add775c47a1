"""Data files shipped with jmtp (prompts for MTP self-distillation; see LICENSE_NOTES.md)."""
