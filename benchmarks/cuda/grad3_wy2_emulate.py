#!/usr/bin/env python3
"""CPU emulation of grad3_wy2_kernel (kernels_src/cuda/delta_chunk_bwd_grad3_wy2.cuh) in float64: the same shared
layout (offsets, row strides, cp.async zero fill, NaN in every word never written), the blocked inverse of I + L,
and the mma.sync m16n8k8 fragment layouts of both products per warp and lane (products exact, no tf32 rounding),
against the old kernel's math (back substitution with (I + L)^T). Checks the index logic without a GPU:
    python benchmarks/cuda/grad3_wy2_emulate.py     # max abs errors ~1e-14 when the indexing is right
"""
import numpy as np
CH=64; KP=128; S=64; LDB=72; LDA=68
buf = CH*LDB + CH*LDA
OFF_AKK=2*buf; OFF_TT=OFF_AKK+CH*LDA; OFF_MS=OFF_TT+CH*LDA; OFF_BE=OFF_MS+768; OFF_DB=OFF_BE+CH; NF=OFF_DB+2*CH

def mma(acc, afr, bfr):
    # afr[lane] = (a0,a1,a2,a3), bfr[lane] = (b0,b1); acc[lane] = [c0..c3]
    A=np.zeros((16,8)); B=np.zeros((8,8))
    for lane in range(32):
        g,t=lane>>2,lane&3
        A[g,t],A[g+8,t],A[g,t+4],A[g+8,t+4]=afr[lane]
        B[t,g],B[t+4,g]=bfr[lane]
    C=A@B
    for lane in range(32):
        g,t=lane>>2,lane&3
        acc[lane][0]+=C[g,2*t]; acc[lane][1]+=C[g,2*t+1]; acc[lane][2]+=C[g+8,2*t]; acc[lane][3]+=C[g+8,2*t+1]

def run(Cc,V,K,rng):
    dU=np.zeros((CH,V)); dU[:Cc]=rng.standard_normal((Cc,V))
    u=np.zeros((CH,V)); u[:Cc]=rng.standard_normal((Cc,V))
    v=rng.standard_normal((CH,V))
    gdw=np.zeros((CH,KP)); gdw[:,:K]=rng.standard_normal((CH,K)); gdw[Cc:]=0
    wc=np.zeros((CH,KP)); wc[:Cc,:K]=rng.standard_normal((Cc,K))
    akk=np.tril(rng.standard_normal((CH,CH))*0.3,-1); akk[Cc:]=0
    akk_in=akk+np.diag(rng.standard_normal(CH))  # garbage on the diagonal: must be ignored
    beta=np.zeros(CH); beta[:Cc]=rng.random(Cc)
    # reference (the old kernel's math)
    L=np.diag(beta)@akk
    dX=np.concatenate([dU, gdw],1); X=np.concatenate([u, wc],1)
    dR=np.linalg.solve((np.eye(CH)+L).T, dX)
    dL=np.tril(-dR@X.T,-1)
    ref_dv=(beta[:,None]*dR[:,:V])[:Cc]
    ref_db=((dR[:,:V]*v).sum(1)+(dL*akk).sum(1))[:Cc]
    ref_gdw=dR[:,V:]; ref_akk=beta[:,None]*dL
    # emulation
    sm=np.full(NF,np.nan)
    nsu=(V+S-1)//S; ns=nsu+(K+S-1)//S
    def issue(s,b):
        for tid in range(256):
            for r in range(4):
                i=tid+r*256; t=i>>4; c4=4*(i&15)
                dx=b*buf; xs=b*buf+CH*LDB
                if s<nsu:
                    c=s*S+c4; ok=t<Cc and c<V
                    sm[dx+t*LDB+c4:dx+t*LDB+c4+4]=dU[t,c:c+4] if ok else 0
                    sm[xs+t*LDA+c4:xs+t*LDA+c4+4]=u[t,c:c+4] if ok else 0
                else:
                    c=(s-nsu)*S+c4
                    sm[dx+t*LDB+c4:dx+t*LDB+c4+4]=gdw_g[t,c:c+4]
                    sm[xs+t*LDA+c4:xs+t*LDA+c4+4]=wc[t,c:c+4] if t<Cc else 0
    gdw_g=gdw.copy(); akk_g=akk_in.copy()
    out_dv=np.full((CH,V),np.nan); out_db=np.full(CH,np.nan)
    for t in range(CH): sm[OFF_BE+t]=beta[t] if t<Cc else 0; 
    for t in range(CH): sm[OFF_AKK+t*LDA:OFF_AKK+t*LDA+CH]=akk_g[t]
    issue(0,0); issue(1,1)
    # T
    for tid in range(64):
        i0=16*(tid>>4); jj=tid&15; x=np.zeros(16)
        for r in range(16):
            s_=sum(sm[OFF_AKK+(i0+r)*LDA+i0+m]*x[m] for m in range(r))
            x[r]=(1.0 if r==jj else 0.0)-sm[OFF_BE+i0+r]*s_
        sm[OFF_TT+(i0+jj)*LDA+i0:OFF_TT+(i0+jj)*LDA+i0+16]=x
    for d in (1,2,3):
        for tid in range(256):
            r=tid>>4; cc=tid&15
            for b in range(4-d):
                i=b+d;j=b;s_=0
                for k in range(j,i):
                    s_+=np.dot(sm[OFF_AKK+(16*i+r)*LDA+16*k:OFF_AKK+(16*i+r)*LDA+16*k+16], sm[OFF_TT+(16*j+cc)*LDA+16*k:OFF_TT+(16*j+cc)*LDA+16*k+16])
                sm[OFF_MS+b*256+tid]=sm[OFF_BE+16*i+r]*s_
        new={}
        for tid in range(256):
            r=tid>>4; cc=tid&15
            for b in range(4-d):
                i=b+d;j=b
                s_=sum(sm[OFF_TT+(16*i+m)*LDA+16*i+r]*sm[OFF_MS+b*256+m*16+cc] for m in range(16))
                new[OFF_TT+(16*j+cc)*LDA+16*i+r]=-s_
        for k_,v_ in new.items(): sm[k_]=v_
    dl=[[[ [0.0]*4 for _ in range(4)] for _ in range(32)] for _ in range(8)]  # [warp][lane][nt][e]
    db=[[[0.0,0.0] for _ in range(32)] for _ in range(8)]
    for s in range(ns):
        b=s&1; us=s<nsu; dx=b*buf; xs=b*buf+CH*LDB
        accs=[]
        for warp in range(8):
            mi,nh=warp&3,warp>>2
            acc=[[[0.0]*4 for _ in range(4)] for _ in range(32)]
            for ks in range(8):
                if ks<2*mi: continue
                for nt in range(4):
                    afr=[];bfr=[]
                    for lane in range(32):
                        gq,t4=lane>>2,lane&3; tr0=16*mi+gq; k0=8*ks+t4
                        ar=OFF_TT+tr0*LDA+k0
                        afr.append((sm[ar],sm[ar+8*LDA],sm[ar+4],sm[ar+8*LDA+4]))
                        br=dx+k0*LDB+32*nh+8*nt+gq
                        bfr.append((sm[br],sm[br+4*LDB]))
                    a=[[acc[l][nt][e] for e in range(4)] for l in range(32)]
                    mma(a,afr,bfr)
                    for l in range(32): acc[l][nt]=a[l]
            accs.append(acc)
        for warp in range(8):
            mi,nh=warp&3,warp>>2; acc=accs[warp]
            for lane in range(32):
                gq,t4=lane>>2,lane&3; tr0=16*mi+gq
                for nt in range(4):
                    c=32*nh+8*nt+2*t4
                    for h in range(2):
                        t=tr0+8*h; r0,r1=acc[lane][nt][2*h],acc[lane][nt][2*h+1]
                        sm[dx+t*LDA+c]=r0; sm[dx+t*LDA+c+1]=r1
                        if us:
                            col=s*S+c
                            if t<Cc and col<V:
                                bt=sm[OFF_BE+t]; out_dv[t,col]=bt*r0; out_dv[t,col+1]=bt*r1
                                db[warp][lane][h]+=r0*v[t,col]+r1*v[t,col+1]
                        else:
                            gdw_g[t,(s-nsu)*S+c]=r0; gdw_g[t,(s-nsu)*S+c+1]=r1
        for warp in range(8):
            mi,nh=warp&3,warp>>2
            for ks in range(8):
                for nt in range(4):
                    if 32*nh+8*nt>16*mi+15: continue
                    afr=[];bfr=[]
                    for lane in range(32):
                        gq,t4=lane>>2,lane&3; tr0=16*mi+gq; k0=8*ks+t4
                        ar=dx+tr0*LDA+k0
                        afr.append((sm[ar],sm[ar+8*LDA],sm[ar+4],sm[ar+8*LDA+4]))
                        br=xs+(32*nh+8*nt+gq)*LDA+k0
                        bfr.append((sm[br],sm[br+4]))
                    a=[dl[warp][l][nt] for l in range(32)]
                    mma(a,afr,bfr)
        if s+2<ns: issue(s+2,b)
    dbs=np.full(2*CH,np.nan)
    for warp in range(8):
        mi,nh=warp&3,warp>>2
        for lane in range(32):
            gq,t4=lane>>2,lane&3; tr0=16*mi+gq
            for nt in range(4):
                j=32*nh+8*nt+2*t4
                for h in range(2):
                    t=tr0+8*h
                    l0=-dl[warp][lane][nt][2*h] if j<t else 0.0
                    l1=-dl[warp][lane][nt][2*h+1] if j+1<t else 0.0
                    if j<t: db[warp][lane][h]+=l0*sm[OFF_AKK+t*LDA+j]
                    if j+1<t: db[warp][lane][h]+=l1*sm[OFF_AKK+t*LDA+j+1]
                    bt=sm[OFF_BE+t]; akk_g[t,j]=bt*l0; akk_g[t,j+1]=bt*l1
        for lane in range(32):
            gq,t4=lane>>2,lane&3
            if t4==0:
                for h in range(2):
                    dbs[nh*CH+16*mi+gq+8*h]=sum(db[warp][lane+q][h] for q in range(4))
    out_db=(dbs[:CH]+dbs[CH:])[:Cc]
    e=lambda a,b: np.abs(a-b).max()
    print(f"Cc={Cc} V={V} K={K}: dv {e(out_dv[:Cc],ref_dv):.1e} dbeta {e(out_db,ref_db):.1e} gdw {e(gdw_g[:, :K],ref_gdw[:, :K]):.1e} "
          f"gdw_pad {np.abs(gdw_g[:,K:]).max() if K<KP else 0:.1e} akk {e(akk_g,ref_akk):.1e} nan_dv {np.isnan(out_dv[:Cc]).any()}")
rng=np.random.default_rng(1)
for Cc,V,K in [(64,128,128),(37,64,128),(64,32,40),(50,96,96),(1,128,128)]:
    run(Cc,V,K,rng)
