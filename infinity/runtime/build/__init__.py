"""Wrap-time building: blocks split and planned, tiers placed, sizes checked, homes filled."""
