// `trellis export CKPT --format hf-gpt2 OUTDIR`: a Hugging Face GPT-2 model directory —
// config.json and model.safetensors, written by Trellis itself — from a checkpoint (serial: no
// MPI, like inspect). Trellis's GPT is GPT-2 (pre-LayerNorm, GELU tanh, tied LM head, biases,
// LayerNorm eps 1e-5) apart from grouped key/value heads, which HF's GPT-2 cannot express:
// such models are refused.
//
// Tensors: Trellis's linear weights are (out, in) like torch.nn.Linear; HF's GPT-2 uses Conv1D,
// whose weights are (in, out): every block's c_attn, c_proj, c_fc weight is transposed. wte,
// wpe, LayerNorms and biases keep their shapes. The LM head is tied to wte (not stored, as HF
// saves it); the checkpoint holds no vocabulary padding.
#pragma once
#include <string>
#include <vector>

namespace trellis {

/// Writes OUTDIR/config.json and OUTDIR/model.safetensors (OUTDIR created if needed). A missing
/// or damaged checkpoint, a GQA model, an unwritable OUTDIR → UserError naming it.
void export_hf_gpt2(const std::string& checkpoint, const std::string& outdir);

/// The command line after `export`; returns the exit status (0, or 2 with the message printed).
int export_main(const std::vector<std::string>& args);

}  // namespace trellis
