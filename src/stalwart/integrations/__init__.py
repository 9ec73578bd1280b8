"""stalwart inside other trainers: each subpackage turns a framework's trainer into a stalwart member.

Nothing here is imported by ``import stalwart``: a subpackage imports its
framework (torchtitan, ...) only when it is used, and stands above
:mod:`stalwart.runtime` in the layers (docs/design.md, "Layers").
"""
