//! A Linear layer over every row of its input as one matrix product, its bias added as PyTorch
//! adds a Linear's on the GPU. candle's `Linear` runs a 3-D input as one product per batch entry
//! against a broadcast weight (which wastes the GPU where there are many short sequences, as
//! Latte's temporal blocks have) and adds the bias in a second pass over the product (a third of
//! FLUX.1's forward went to those adds). On CUDA bf16 the bias, and a tanh GELU where asked, go
//! into the product's epilogue instead: the f32 accumulator gets the bias before the one rounding
//! to bf16, as `addmm` does. Elsewhere: the product, then the bias (and the GELU), as candle adds
//! them.
//!
//! [`Projection`] is a Linear whose product may instead be an fp8 one (`--fp8-matmul`,
//! [`crate::models::fp8`]).

use std::cell::OnceCell;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Linear;

use crate::models::fp8::{self, Fp8Rows};

/// A DiT's Linear layer, its product exact or (`fp8`) in e4m3 with per-channel and per-token
/// scales. The fp8 weight is made from the landed weight at the layer's first product: once per
/// landing (a streamed block is built anew each time it lands), and never for a build that only
/// records which weights a block asks for (those are not real tensors).
#[derive(Debug, Clone)]
pub struct Projection {
    linear: Linear,
    /// The quantized weight once made (shared by clones of the layer); `None`: exact.
    fp8: Option<Arc<OnceLock<Fp8Rows>>>,
}

impl Projection {
    /// `linear`, in fp8 where `fp8`.
    pub fn new(linear: Linear, fp8: bool) -> Self {
        Self {
            linear,
            fp8: fp8.then(Default::default),
        }
    }

    pub fn weight(&self) -> &Tensor {
        self.linear.weight()
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.linear.bias()
    }

    /// The fp8 product of `x` `[..., in]`, plus `bias` and then GELU(tanh) where `gelu`; `None`
    /// for an exact layer (the caller computes it its own way).
    pub fn fp8_product(
        &self,
        x: &Input,
        bias: Option<&Tensor>,
        gelu: bool,
    ) -> Result<Option<Tensor>> {
        let Some(cell) = &self.fp8 else {
            return Ok(None);
        };
        let weight = self.fp8_weight(cell)?;
        let codes = &x.codes;
        let x = match x.values {
            Values::Tensor(x) => x,
            Values::Coded(dtype) => {
                let Some(codes) = codes.get() else {
                    candle_core::bail!("a coded Linear input without its codes")
                };
                return fp8::linear_codes(codes, dtype, weight, bias, gelu).map(Some);
            }
        };
        let dims = x.dims();
        let Some((&inner, outer)) = dims.split_last() else {
            candle_core::bail!("a Linear layer's input needs at least one dimension")
        };
        let mut shape = outer.to_vec();
        shape.push(weight.rows);
        let rows = x.reshape(((), inner))?;
        fp8::linear_sharing(&rows, codes, weight, bias, gelu)?
            .reshape(shape)
            .map(Some)
    }

    /// The input of the next fp8 layer, by its codes alone: GELU(tanh)(`x W^T + b`) of `x`
    /// `[rows, in]` ([`fp8::gelu_codes`], the activations never stored); `None` for an exact
    /// layer (the caller computes it its own way).
    pub fn fp8_gelu_codes<'a>(&self, x: &Input) -> Result<Option<Input<'a>>> {
        let Some(cell) = &self.fp8 else {
            return Ok(None);
        };
        let (Values::Tensor(t), Some(bias)) = (&x.values, self.bias()) else {
            candle_core::bail!("fp8 GELU codes need a Linear with a bias over a stored input")
        };
        let codes = fp8::gelu_codes(t, &x.codes, self.fp8_weight(cell)?, bias)?;
        Ok(Some(Input {
            values: Values::Coded(t.dtype()),
            codes: OnceCell::from(codes),
        }))
    }

    /// The layer's fp8 weight, made at its first product.
    fn fp8_weight<'c>(&self, cell: &'c OnceLock<Fp8Rows>) -> Result<&'c Fp8Rows> {
        Ok(match cell.get() {
            Some(w) => w,
            None => {
                // Two threads may both quantize a layer; they make the same codes.
                let _ = cell.set(Fp8Rows::quantize(self.weight(), true)?);
                cell.get().unwrap_or_else(|| unreachable!("set above"))
            }
        })
    }
}

/// A Linear's input `[..., in]`, with the e4m3 codes of its rows made by the first fp8 layer
/// that reads it and kept for the others that read it too; or an input known by its codes alone
/// ([`Projection::fp8_gelu_codes`]), which only fp8 layers take.
pub struct Input<'a> {
    values: Values<'a>,
    codes: OnceCell<Fp8Rows>,
}

/// What an [`Input`] holds besides its codes.
enum Values<'a> {
    Tensor(&'a Tensor),
    /// No values: the codes of rows in this dtype.
    Coded(DType),
}

impl<'a> Input<'a> {
    pub fn new(x: &'a Tensor) -> Self {
        Self {
            values: Values::Tensor(x),
            codes: OnceCell::new(),
        }
    }

    /// The input's values; an error for an input known by its codes alone.
    pub fn tensor(&self) -> Result<&'a Tensor> {
        match self.values {
            Values::Tensor(x) => Ok(x),
            Values::Coded(_) => {
                candle_core::bail!("an exact Linear layer over an input known only by fp8 codes")
            }
        }
    }
}

impl Module for Projection {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.fp8_product(&Input::new(x), self.bias(), false)? {
            Some(y) => Ok(y),
            None => self.linear.forward(x),
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn randn(shape: (usize, usize), std: f32) -> Result<Tensor> {
        Tensor::randn(0f32, std, shape, &Device::Cpu)?.to_dtype(DType::BF16)
    }

    /// A feed-forward's hidden activations pass from one fp8 layer to the next as codes: the
    /// second layer's output is its fp8 product over GELU(x W1^T + b1) computed in the
    /// definition's steps (`fp8::gelu_codes`: the product rounded, then the bias and GELU);
    /// an exact layer refuses such an input.
    #[test]
    fn hidden_codes_feed_the_next_fp8_layer() -> Result<()> {
        let (rows, dim, hidden) = (6, 32, 48);
        let x = randn((rows, dim), 1.0)?;
        let layer = |inner, out| -> Result<Linear> {
            let bias = randn((1, out), 0.5)?.squeeze(0)?;
            Ok(Linear::new(randn((out, inner), 0.1)?, Some(bias)))
        };
        let (up, down) = (layer(dim, hidden)?, layer(hidden, dim)?);
        let (fc1, fc2) = (
            Projection::new(up.clone(), true),
            Projection::new(down.clone(), true),
        );
        let input = Input::new(&x);
        let coded = fc1.fp8_gelu_codes(&input)?.expect("an fp8 layer");
        let got = fc2.fp8_product(&coded, None, false)?.expect("an fp8 layer");

        let w1 = Fp8Rows::quantize(up.weight(), true)?;
        let product = fp8::linear(&x, &w1, None, false)?;
        let h = fp8::bias_gelu(&product, up.bias().expect("a bias"))?;
        let want = fp8::linear(&h, &Fp8Rows::quantize(down.weight(), true)?, None, false)?;
        assert_eq!(got.dims(), [rows, dim]);
        let diff = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);

        let exact = Projection::new(down, false);
        assert!(exact.fp8_gelu_codes(&input)?.is_none());
        assert!(coded.tensor().is_err());
        Ok(())
    }
}
