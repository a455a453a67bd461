"""The report stage of `ssl-vit evaluate` and `compare`: tables, paired differences and verdicts, plots
and the writer of the output directory. It reads the results the ranks computed and computes nothing
a rank could have."""
