//! A Linear layer over every row of its input as one matrix product, its bias added as PyTorch
//! adds a Linear's on the GPU. candle's `Linear` runs a 3-D input as one product per batch entry
//! against a broadcast weight (which wastes the GPU where there are many short sequences, as
//! Latte's temporal blocks have) and adds the bias in a second pass over the product (a third of
//! FLUX.1's forward went to those adds). On CUDA bf16 the bias, and a tanh GELU where asked, go
//! into the product's epilogue instead: the f32 accumulator gets the bias before the one rounding
//! to bf16, as `addmm` does. Elsewhere: the product, then the bias (and the GELU), as candle adds
//! them.

use candle_core::{Module, Result, Tensor};
use candle_nn::Linear;

/// `linear` of `x` `[..., in]`.
pub fn project(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    rows_through(linear, x, false)
}

/// GELU (tanh approximation) of `linear` of `x` `[..., in]`.
pub fn project_gelu_tanh(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    rows_through(linear, x, true)
}

fn rows_through(linear: &Linear, x: &Tensor, gelu: bool) -> Result<Tensor> {
    let dims = x.dims();
    let Some((&inner, outer)) = dims.split_last() else {
        candle_core::bail!("a Linear layer's input needs at least one dimension")
    };
    let rows = x.reshape(((), inner))?;
    let mut shape = outer.to_vec();
    shape.push(linear.weight().dim(0)?);
    #[cfg(feature = "cuda")]
    if let Some(bias) = linear.bias() {
        if let Some(y) = crate::models::linear::linear_bias_act(&rows, linear.weight(), bias, gelu)?
        {
            return y.reshape(shape);
        }
    }
    let y = linear.forward(&rows)?;
    let y = if gelu { y.gelu()? } else { y };
    y.reshape(shape)
}
