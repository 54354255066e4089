"""Near-duplicate detection of pre-training images against downstream test sets (paper Section 4.1, after BiT)."""
