"""The report stage of `ssl-vit evaluate` and `compare`: tables, paired differences and verdicts, plots,
the writer of the output directory, and `compare`, which has the ranks evaluate and then writes. It
reads the results the ranks computed and computes nothing a rank could have."""
