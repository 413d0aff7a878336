"""evaluation: the exported ONNX model on the test set (scoring), and the pictures of it;
the drift report (drift_report, drift_plots: matplotlib, so not in the bento's watch/)."""
