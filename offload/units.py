"""The one GiB constant: every byte count shown or configured in GiB converts through it."""

GIB = 2**30
