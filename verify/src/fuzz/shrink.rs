//! Shrinking a failing case: greedy, smallest step first, each step kept
//! only while the case still fails in the same way (same failing tensors,
//! same likely cause) and stays valid for the convention.

use deltaref::inputs::Regime;

use super::draw::{Extra, FuzzConfig, Params};

/// Smaller variants of `p`, the largest reductions first: no CP, fewer
/// sequences, shorter sequences, fewer CP ranks, no initial state, plainer
/// inputs and switches, fewer heads, smaller K and V (never the `--fix`ed
/// ones). Cut points a shorter case no longer holds are dropped
/// ([`Params::fit_cuts`]).
pub fn smaller(p: &Params) -> Vec<Params> {
    let mut out = vec![];
    let mut push = |f: &dyn Fn(&mut Params)| {
        let mut q = p.clone();
        f(&mut q);
        q.fit_cuts();
        if &q != p {
            out.push(q);
        }
    };
    push(&|q| q.cuts = None);
    for i in 0..p.lengths.len() {
        push(&|q| {
            if q.lengths.len() > 1 {
                q.set_length(i, 0);
                q.lengths.remove(i);
            }
        });
    }
    for i in 0..p.lengths.len() {
        let cuts: [fn(usize) -> usize; 4] = [
            |l| l / 2,
            |l| l.min(1),
            |l| l.saturating_sub(1),
            |l| l.min(32),
        ];
        for cut in cuts {
            push(&|q| {
                if q.varlen || q.lengths.len() == 1 {
                    q.set_length(i, cut(q.lengths[i]).max(usize::from(!q.varlen)));
                } else {
                    let l = cut(q.lengths[0]).max(1);
                    q.lengths.iter_mut().for_each(|x| *x = l);
                }
            });
        }
    }
    for i in 0..p.cuts.as_ref().map_or(0, Vec::len) {
        push(&|q| {
            if let Some(c) = q.cuts.as_mut() {
                c.remove(i);
            }
        });
        let moves: [fn(usize) -> usize; 2] = [|x| x / 2, |x| x - 1];
        for m in moves {
            push(&|q| {
                if let Some(c) = q.cuts.as_mut() {
                    c[i] = m(c[i]);
                    c.sort_unstable();
                }
            });
        }
    }
    push(&|q| q.initial_state = false);
    push(&|q| q.extra = Extra::None);
    push(&|q| q.regime = Regime::FlaTest);
    push(&|q| q.gate = false);
    push(&|q| q.beta_sigmoid = false);
    push(&|q| q.l2norm = false);
    push(&|q| q.activation = false);
    push(&|q| q.bias = false);
    push(&|q| q.varlen = false);
    push(&|q| q.hv = q.h);
    push(&|q| {
        let r = q.hv / q.h.max(1);
        if q.h > 1 {
            q.h -= 1;
            q.hv = q.h * r;
        }
    });
    push(&|q| {
        let r = q.hv / q.h.max(1);
        if r > 2 {
            q.hv = q.h * 2;
        }
    });
    let dims: [fn(usize) -> usize; 2] = [|d| d / 2, |d| d.saturating_sub(1)];
    for f in dims {
        push(&|q| {
            q.k = f(q.k).max(1);
            q.v = f(q.v).max(1);
        });
        push(&|q| q.k = f(q.k).max(1));
        push(&|q| q.v = f(q.v).max(1));
    }
    out
}

/// The smallest variant of `start` reached greedily for which `fails`
/// returns `signature` (the way `start` fails), trying at most `budget`
/// variants; with how many were tried.
pub fn shrink(
    cfg: &FuzzConfig,
    start: Params,
    signature: &str,
    budget: usize,
    mut fails: impl FnMut(&Params) -> Option<String>,
) -> (Params, usize) {
    let mut best = start;
    let mut tried = 0;
    'outer: while tried < budget {
        for q in smaller(&best) {
            if !cfg.allows(&q) {
                continue;
            }
            if tried >= budget {
                break 'outer;
            }
            tried += 1;
            if fails(&q).as_deref() == Some(signature) {
                best = q;
                continue 'outer;
            }
        }
        break;
    }
    (best, tried)
}
