//! The naive recurrent form, FLA's `naive_recurrent_gdn2` one token at a
//! time: decay `S̃ = Diag(e^g) S`, erase-read `e = S̃ᵀ(b ⊙ k)`, write
//! `S = S̃ + k (w ⊙ v − e)ᵀ`, read out `o = Sᵀq`.
//!
//! Backward is the reverse-time recurrence, derived by hand. States are kept
//! at checkpoints every `⌈√L⌉` tokens and a block's states recomputed from
//! its checkpoint, so a long piece costs `O(√L · K · V)` memory rather than
//! `O(L · K · V)`.

use ndarray::{Array1, Array2, ArrayView2, Axis};

use super::{outer, scale_rows, Gdn2, Gdn2Head, Gdn2HeadGrads};
use crate::op::Engine;
use crate::scalar::Scalar;

/// The naive recurrent engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct Naive;

/// What token `t` computes from `S_{t−1}` before writing: the decay `e^g
/// [K]`, the decayed state `S̃ [K, V]`, the gated key `b ⊙ k [K]` and
/// `v_new = w ⊙ v − S̃ᵀ(b ⊙ k) [V]`.
struct Token<T> {
    decay: Array1<T>,
    s_dec: Array2<T>,
    bk: Array1<T>,
    v_new: Array1<T>,
}

impl<T: Scalar> Token<T> {
    fn new(x: &Gdn2Head<T>, t: usize, s_prev: &Array2<T>) -> Self {
        let decay = x.g.row(t).mapv(T::exp);
        let mut s_dec = s_prev.clone();
        scale_rows(&mut s_dec, decay.view());
        let bk = &x.b.row(t) * &x.k.row(t);
        let v_new = &(&x.w.row(t) * &x.v.row(t)) - &s_dec.t().dot(&bk);
        Token {
            decay,
            s_dec,
            bk,
            v_new,
        }
    }

    /// `S_t = S̃ + k v_newᵀ`.
    fn state(&self, x: &Gdn2Head<T>, t: usize) -> Array2<T> {
        &self.s_dec + &outer(x.k.row(t), self.v_new.view())
    }
}

/// Tokens per checkpoint block of an `l`-token piece: `⌈√l⌉`.
fn block_len(l: usize) -> usize {
    (1..).find(|b| b * b >= l).expect("some b").max(1)
}

/// `(o [L, V], S_L)` from `S_0 = h0`, keeping `S_{t−1}` of every token
/// `t` that starts a block of `block` tokens when `checkpoints` is given.
fn run<T: Scalar>(
    x: &Gdn2Head<T>,
    h0: ArrayView2<T>,
    block: usize,
    mut checkpoints: Option<&mut Vec<Array2<T>>>,
) -> (Array2<T>, Array2<T>) {
    let mut o = Array2::zeros((x.len(), x.v_dim()));
    let mut s = h0.to_owned();
    for t in 0..x.len() {
        if let Some(c) = checkpoints.as_deref_mut().filter(|_| t % block == 0) {
            c.push(s.clone());
        }
        s = Token::new(x, t, &s).state(x, t);
        o.row_mut(t).assign(&s.t().dot(&x.q.row(t)));
    }
    (o, s)
}

impl<T: Scalar> Engine<T> for Naive {
    type Op = Gdn2;

    fn forward(&self, x: &Gdn2Head<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        run(x, h0, 1, None)
    }

    fn backward(
        &self,
        x: &Gdn2Head<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> Gdn2HeadGrads<T> {
        let (l, kd, vd) = (x.len(), x.k_dim(), x.v_dim());
        let block = block_len(l);
        let mut checkpoints = Vec::new();
        run(x, h0, block, Some(&mut checkpoints));
        let mut gr = Gdn2HeadGrads::zeros(l, kd, vd);
        // ∂L/∂S_t, walking t down.
        let mut ds = dht.to_owned();
        for (b, start) in (0..l).step_by(block).enumerate().rev() {
            let end = (start + block).min(l);
            // S_{t−1} for t in start..end, from the block's checkpoint.
            let mut before = vec![checkpoints[b].clone()];
            for t in start..end - 1 {
                let next = Token::new(x, t, &before[t - start]).state(x, t);
                before.push(next);
            }
            for t in (start..end).rev() {
                ds = token_backward(x, t, &before[t - start], d_o, ds, &mut gr);
            }
        }
        gr.dh0 = ds;
        gr
    }
}

/// The gradients of token `t` into `gr`'s row `t`, from `S_{t−1}` and
/// `ds = ∂L/∂S_t`; returns `∂L/∂S_{t−1}`. With `S̃`, `v_new` as in
/// [`Token`] and `S_t = S̃ + k v_newᵀ`, `o = S_tᵀ q`:
/// `dq = S_t do`; `dS_t += q doᵀ`; `dv_new = dS_tᵀ k`; `dk = dS_t v_new`;
/// `d(b ⊙ k) = −S̃ dv_new`; `dv = w ⊙ dv_new`, `dw = v ⊙ dv_new`;
/// `dS̃ = dS_t − (b ⊙ k) dv_newᵀ`; `dg = Σ_V dS̃ ⊙ S̃` (row sums);
/// `dS_{t−1} = Diag(e^g) dS̃`.
fn token_backward<T: Scalar>(
    x: &Gdn2Head<T>,
    t: usize,
    s_prev: &Array2<T>,
    d_o: ArrayView2<T>,
    mut ds: Array2<T>,
    gr: &mut Gdn2HeadGrads<T>,
) -> Array2<T> {
    let tok = Token::new(x, t, s_prev);
    let (k, d_o) = (x.k.row(t), d_o.row(t));
    gr.dq.row_mut(t).assign(&tok.state(x, t).dot(&d_o));
    ds += &outer(x.q.row(t), d_o);
    let dv_new = ds.t().dot(&k);
    let dbk = -tok.s_dec.dot(&dv_new);
    let dk = &ds.dot(&tok.v_new) + &(&x.b.row(t) * &dbk);
    gr.dk.row_mut(t).assign(&dk);
    gr.db.row_mut(t).assign(&(&k * &dbk));
    gr.dv.row_mut(t).assign(&(&x.w.row(t) * &dv_new));
    gr.dw.row_mut(t).assign(&(&x.v.row(t) * &dv_new));
    ds -= &outer(tok.bk.view(), dv_new.view());
    gr.dg
        .row_mut(t)
        .assign(&(&ds * &tok.s_dec).sum_axis(Axis(1)));
    scale_rows(&mut ds, tok.decay.view());
    ds
}
